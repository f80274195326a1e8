"""One command for every rank of a launcher such as torchrun: rank 0 serves, the others work.

    torchrun --nnodes 2 --nproc-per-node 1 --node-rank $NODE_RANK \\
        --master-addr $HEAD_NODE --master-port 29500 \\
        -m backends.torch.parallel.launch [--device cuda] -- \\
        carousel serve --tensor-parallel-size 2 --device cuda

The launcher sets `MASTER_ADDR`, `MASTER_PORT`, `RANK`, `WORLD_SIZE` and `LOCAL_RANK` for
each process. On `RANK` 0 this module becomes the command after `--` (exec: same pid and
environment, so the server joins the group from the environment and torchrun still watches
it); on every other rank it runs the worker loop (worker.py) with `--device` and
`--timeout-s`, which must match the server's device type.
"""

from __future__ import annotations

import os
import sys

from backends.torch.parallel import worker


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if "--" not in args:
        print(__doc__, file=sys.stderr)
        return 2
    split = args.index("--")
    own, command = args[:split], args[split + 1 :]
    if not command:
        print("nothing to run on rank 0 after `--`", file=sys.stderr)
        return 2
    if int(os.environ.get("RANK", "0")) == 0:
        os.execvp(command[0], command)
    return worker.main(own)


if __name__ == "__main__":
    sys.exit(main())
