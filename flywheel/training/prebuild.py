"""Compile and cache the DeepSpeed C++ ops that training loads at start-up.

On a CPU box, DeepSpeed's communication backend JIT-compiles its shared-memory op
(`deepspeed_shm_comm`) with g++ the first time a process group is created: 30-60 s on a small
machine. The op is DeepSpeed's all-reduce between processes on one host, so a single-process run
has no use for it: `without_shm_op()` keeps DeepSpeed from loading it there (the embedded default
and `make demo` train in one process and never build it). Runs with several CPU ranks do load it;
this module builds it once into a folder inside the virtual environment, and
`ensure_extensions_dir()` points later processes at that folder, so `deepspeed.initialize` takes
about a second instead of each fresh environment paying the compile.

`make install-dev` (and so `make test`, whose two-rank test loads the op) runs it; run it yourself
before a first multi-rank CPU run (idempotent: a second run finds the cache and only loads it):

    python -m flywheel.training.prebuild

The cache folder is `$TORCH_EXTENSIONS_DIR` when set, else `<venv>/torch_extensions`. The training
loop imports `ensure_extensions_dir()` so it uses the same folder. No optimizer op is built: the
loop always passes a torch optimizer (a DeepSpeed `optimizer` block would compile another ~90 s).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# Ops the training loop may JIT-load. Only the shared-memory comm op is built by default
# (CPU accelerator); CUDA builds use NCCL and load no op here.
OPS = ("ShareMemCommBuilder",)
SHM_OP = "deepspeed_shm_comm"  # the builder's NAME, the key DeepSpeed checks before loading it


@contextmanager
def without_shm_op() -> Iterator[None]:
    """While inside, DeepSpeed treats the shared-memory comm op as unavailable and does not load it.

    DeepSpeed's torch backend builds the op when it is created (in `deepspeed.init_distributed`)
    only if its table of compatible ops says yes; a single-process group is created inside this
    block, so it keeps no op and its collectives go through torch.distributed (gloo). The table is
    restored on the way out, so a later multi-rank start in the same process is unaffected.
    """
    import deepspeed.ops

    table = deepspeed.ops.__compatible_ops__
    before = table.get(SHM_OP, False)
    table[SHM_OP] = False
    try:
        yield
    finally:
        table[SHM_OP] = before


def ensure_extensions_dir() -> Path:
    """Point torch's JIT extension cache at the venv (unless the user chose a folder); return it.

    Must run before DeepSpeed loads an op; sys.prefix is the venv root when run from a venv.
    """
    folder = os.environ.setdefault(
        "TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions")
    )
    return Path(folder)


def prebuild() -> list[str]:
    """Build (or load from the cache) each op in OPS; return one line per op saying what happened."""
    cache = ensure_extensions_dir()
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    lines = []
    for op in OPS:
        builder = accelerator.create_op_builder(op)
        if builder is None or not builder.is_compatible(verbose=False):
            lines.append(f"{op}: not used on accelerator {accelerator.device_name()}, skipped")
            continue
        # torch names the build folder after the op; a built .so there means a cache hit.
        cached = any((cache / builder.name).glob("*.so"))
        start = time.perf_counter()
        builder.load(verbose=False)
        seconds = time.perf_counter() - start
        verb = "loaded from cache" if cached else "compiled"
        lines.append(f"{builder.name}: {verb} in {seconds:.2f} s ({cache / builder.name})")
    return lines


def main() -> None:
    for line in prebuild():
        print(line)


if __name__ == "__main__":
    main()
