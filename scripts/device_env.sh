# Sourced by the device scripts (gpu_measure.sh, gpu_recipe.sh, gpu_results.sh): the Python path with the wheels
# the device image lacks (installed once from .whl/ into /tmp/site), and `dequantised_teacher MODEL DIR`, which
# saves the teacher once as a plain model directory that every stage then loads quickly.
if [ -d .whl ] && [ ! -f /tmp/site/.installed ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null &&
    touch /tmp/site/.installed
fi
if [ -d /tmp/site ]; then
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi

dequantised_teacher() {
  [ -d "$2" ] || python3 -c "
from convert.sources import Source
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
