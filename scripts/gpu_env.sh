# Sourced at the start of every command on a lent GPU machine, after `scripts/gpu_wheels.sh` made
# .whl here and the call carries it: installs the wheels into /tmp/site, generates the gRPC stubs
# with the carried grpcio-tools 1.84 (the image's grpcio refuses newer stubs) and puts the
# checkout on PYTHONPATH.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || return 1
export PYTHONPATH="$PWD:/tmp/site" PYTHONUNBUFFERED=1
python3 -c '
source = open("setup.py").read().rsplit("\nsetup(", 1)[0]  # everything but the setup() call
namespace = {"__name__": "stubs", "__file__": "setup.py"}
exec(compile(source, "setup.py", "exec"), namespace)
namespace["generate_stubs"]()
' || return 1
