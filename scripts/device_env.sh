# Sourced by the device scripts (gpu_measure.sh, gpu_recipe.sh): the Python path with the wheels the device image
# lacks (installed from .whl/ when it exists), and `dequantised_teacher MODEL DIR`, which saves the teacher once
# as a plain model directory that every stage then loads quickly.
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>/dev/null
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
