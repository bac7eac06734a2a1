"""torchrun, started with the garbage collector off while it imports: ``python -m mlora_lab.job.torchrun ARGS``
runs exactly ``python -m torch.distributed.run ARGS`` (its ``main``, its arguments, its rendezvous backends
from the ``torchrun.handlers`` entry points). The launcher and the Slurm script start a job's agent this way.

Why: an agent imports torch and its elastic package, some hundred thousand objects that live as long as the
agent does, and the collector's passes over them while they are made find nothing to free. Off while they
are made, and then frozen out of its later passes (as a job's own processes do: :mod:`mlora_lab.job.__main__`),
the agent's start costs 2.1-2.6 s of CPU instead of 2.9-3.3 s on the lab machine, once per node of every
job started.
"""

# ruff: noqa: E402 (the collector goes off before the imports below)
import gc

gc.disable()

from torch.distributed.run import main

gc.freeze()
gc.enable()

if __name__ == "__main__":
    main()
