"""The torchrun process: everything that runs on a training rank.

``python -m mlora_lab.job RUN_DIR [--resume]`` (started by torchrun: :mod:`mlora_lab.job.__main__`) builds
a :class:`~mlora_lab.job.trainer.Trainer` and trains. The rooms: :mod:`.trainer` (the composer and the
loop), :mod:`.engine` (base + slots, the one forward), :mod:`.tenants` (the pool of tenants and slots),
:mod:`.agree` (prepare → agree → commit or undo), :mod:`.driver` / :mod:`.drivers` / :mod:`.filedata`
(where the loop's work comes from), :mod:`.control` (control messages), :mod:`.search` (the in-job
search), :mod:`.checkpointer`, :mod:`.recorder` (metrics rows and meters).

Nothing here imports the notebook side (:mod:`mlora_lab.lab`): the two meet only in the run directory.
"""
