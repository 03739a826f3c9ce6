# Sourced in the repository root by the device scripts (scripts/lab/gpu_*.sh), or by hand
# before `python -m pytest` or `python scripts/...` in a checkout that is not installed: the Python path with the
# wheels the device image lacks (installed once from .whl/ into /tmp/site) and the toolkit under its installed import
# names, and `dequantised_teacher MODEL DIR`, which saves the teacher once as a plain model directory that every
# stage then loads quickly.
#
# pyproject.toml installs the folders convert/ and kernels/ as raven_convert and raven_kernels. Without installing,
# .packages/ gives them those names: relative links to the folders, so the snapshot of the checkout a background job
# runs in (gpu_jobs.sh) imports its own copy, where an editable install would point at the live checkout.
if [ -d .whl ] && [ "$(cat /tmp/site/.installed 2>/dev/null)" != "$(ls .whl)" ]; then  # again when .whl/ changed
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    2>/dev/null && ls .whl >/tmp/site/.installed
fi
mkdir -p .packages
for link in raven_convert:convert raven_kernels:kernels raven_layers:raven_layers; do
  ln -sfn "../${link#*:}" ".packages/${link%%:*}"
done
if [ -d /tmp/site ]; then
  export PYTHONPATH=/tmp/site:$PWD/.packages
else
  export PYTHONPATH=$PWD/.packages
fi

dequantised_teacher() {
  [ -d "$2" ] || python3 -c "
from raven_convert.sources import Source
s = Source.resolve('$1')
s.load_model('float32').save_pretrained('$2')
s.load_tokenizer().save_pretrained('$2')"
}

local_paths() {  # LOCAL_PATHS: the flags that point a recipe at the device's copies (TEACHER, CORPUS, ESSAYS)
  LOCAL_PATHS=(--src "$TEACHER" --data "$CORPUS" --set export=null)
  if [ -n "${ESSAYS:-}" ]; then
    LOCAL_PATHS+=(--haystack "$ESSAYS" --ppl-data "$ESSAYS")
  fi
}
