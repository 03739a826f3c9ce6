"""The mixers a model carries from outside the raven_layers package, registered when registry.py is imported.

None in the package itself. The exporter writes this file into every model directory, importing each such mixer's
module, bundled beside it as mixer_NAME.py (see convert/bundle.py).
"""

MIXERS = ()
