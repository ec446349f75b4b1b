#!/usr/bin/env bash
# Make the virtual environments of `moe-bench layer`'s peers, apart from this project's environment:
#   DIR/torchtitan  torch 2.13.0, triton, torchtitan 0.3.0   (torchtitan pins its own `datasets`)
#   DIR/megatron    torch 2.13.0, megatron-core 0.19.2        (needs Python >= 3.12)
# usage: setup.sh [DIR]   (default: $MOE_BENCH_PEERS or ~/.cache/moe-bench/peers, where moe-bench layer looks)
# Interpreters: $PYTHON_TORCHTITAN (default python3) and $PYTHON_MEGATRON (default python3.12).
# A peer whose environment cannot be made is reported and skipped; its row in moe-bench layer says why.
set -u
DIR="${1:-${MOE_BENCH_PEERS:-$HOME/.cache/moe-bench/peers}}"
TORCH="${TORCH_SPEC:-torch==2.13.0}"
mkdir -p "$DIR"
status=0

make_env() {  # make_env NAME PYTHON PACKAGES...
    local name=$1 python=$2
    shift 2
    if ! command -v "$python" >/dev/null 2>&1; then
        echo "setup.sh: $name skipped: no interpreter '$python' (set PYTHON_${name^^})" >&2
        status=1
        return
    fi
    echo "setup.sh: $name: $("$python" --version 2>&1) in $DIR/$name: $*"
    if "$python" -m venv "$DIR/$name" && "$DIR/$name/bin/python" -m pip install -q "$@" \
        && "$DIR/$name/bin/python" -c "import torch; print('setup.sh: $name ready, torch', torch.__version__)"; then
        return
    fi
    echo "setup.sh: $name failed (see pip's output above)" >&2
    status=1
}

make_env torchtitan "${PYTHON_TORCHTITAN:-python3}" "$TORCH" triton torchtitan==0.3.0
make_env megatron "${PYTHON_MEGATRON:-python3.12}" "$TORCH" megatron-core==0.19.2
echo "setup.sh: moe-bench layer finds them in $DIR (or pass --peer-python NAME=$DIR/NAME/bin/python)"
exit $status
