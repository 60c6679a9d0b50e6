# Sourced at the start of every command on a lent GPU machine, after `scripts/gpu_wheels.sh` made
# .whl here and the call carries it: installs the wheels into /tmp/site, generates the gRPC stubs
# with the carried grpcio-tools 1.84 (the image's grpcio refuses newer stubs) and puts the
# checkout on PYTHONPATH. A later call on the same warm machine need not carry .whl again (a
# path not carried is removed there; /tmp/site stays): without .whl it keeps /tmp/site.
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || return 1
elif [[ ! -d /tmp/site ]]; then
  echo "gpu_env: no .whl here and no /tmp/site: carry .whl (scripts/gpu_wheels.sh)" >&2
  return 1
fi
export PYTHONPATH="$PWD:/tmp/site" PYTHONUNBUFFERED=1
python3 -c '
source = open("setup.py").read().rsplit("\nsetup(", 1)[0]  # everything but the setup() call
namespace = {"__name__": "stubs", "__file__": "setup.py"}
exec(compile(source, "setup.py", "exec"), namespace)
namespace["generate_stubs"]()
' || return 1
# What travels in parts stays on the machine between calls: the tokenizer (tests/gpu and the
# random checkpoints read it) and the GGUF's parts, joined once all three have come.
if [[ -d .gpu/tokenizer ]]; then
  mkdir -p /tmp/specsplit/tokenizer && cp -r .gpu/tokenizer/. /tmp/specsplit/tokenizer/
fi
[[ -d /tmp/specsplit/tokenizer ]] && export SPECSPLIT_TEST_TOKENIZER=/tmp/specsplit/tokenizer
if compgen -G ".gpu/gguf/p*" >/dev/null; then
  mkdir -p /tmp/specsplit/gguf && cp .gpu/gguf/p* /tmp/specsplit/gguf/
fi
if [[ ! -f /tmp/specsplit/smollm2.gguf && -f /tmp/specsplit/gguf/p0 && -f /tmp/specsplit/gguf/p1 &&
  -f /tmp/specsplit/gguf/p2 ]]; then
  cat /tmp/specsplit/gguf/p{0,1,2} >/tmp/specsplit/smollm2.gguf
fi
[[ -f /tmp/specsplit/smollm2.gguf ]] && export SMOLLM2_GGUF=/tmp/specsplit/smollm2.gguf
true
