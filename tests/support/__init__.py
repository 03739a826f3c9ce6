"""Code the tests use as a user's own would be: a mixer declared outside the toolkit (gla_mixer.py) and its report
pictures (gla_pictures.py)."""
