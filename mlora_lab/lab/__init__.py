"""The notebook and CLI process: everything that launches, follows, steers and compares jobs.

This side never imports the job (``mlora_lab.job``): the two meet in the run directory
(:mod:`mlora_lab.rundir`), which this side reads and where it writes control messages.

Rooms by concern, from the bottom up; each imports only rooms above it in this list (the walls are
``LAB_ROOMS`` in ``tests/test_layering.py``)::

    tables, plotting, exports     fitted DataFrames; how the lab draws; adapters out (merged, GGUF, Hub)
    slurm/                        what mlora_lab knows of Slurm: options, batch script, sbatch's reading, its answers
    records/                      what a run directory records: logs, the series plots draw, trials, usage
    launchers/                    the launcher seam (base), its registry and engines (local, Slurm, Ray), liveness
    dashboard/                    the live view: model, runs table, figures, logs and export
    runs/                         the handles: Run (+ Request), ServedRun, SweepRun, attach, tenant rows
    launch, sweeps                ml.launch / resume / serve (launchers called by name), ml.sweep
    evals/                        ml.evaluate, Evaluation, the eval table
    compare/                      runs, summary, compare, plot_losses, hparams, compare_generations
    forms/                        the notebook forms (TenantForm, JobBuilder) and their field inputs
    demo, cli                     the ``mlora-lab`` command line and its demo

Two calls go down-room, inside functions: ``Run.dashboard()`` and ``SweepRun.dashboard()`` open a board
(the dashboard works on run directories: a :class:`~mlora_lab.lab.runs.run.Run` is one, ``os.fspath(run)``).
"""
