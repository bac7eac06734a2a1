"""The notebook and CLI process: everything that launches, follows, steers and compares jobs.

This side never imports the job (``mlora_lab.job``): the two meet in the run directory
(:mod:`mlora_lab.rundir`), which this side reads and where it writes control messages.

Layered from the bottom up (a module imports only modules above it in this list, never below)::

    slurm, threads, logs              Slurm's commands, torch threads per process, log tails
    liveness                          a run's state from status.json, its process and Slurm (explicit records)
    series, plotting                  what the plots draw (over a run directory), and how
    trials                            a search's trials and results, from sweep.json / search.json
    dashboard/                        the live view: model, runs table, figures, logs and export
    run                               the Run handle (+ Request): reads files, writes control messages
    sweep_run, served_run             SweepRun, ServedRun: the handles of a run that searches, that serves
    handles                           attach(), as_runs(): the handle a run directory calls for
    launcher                          launch, resume: local torchrun or Slurm
    sweeps                            ml.sweep: a search launched in one job
    report                            runs, summary, compare, plot_losses
    hparams, generations              hparams (a sweep's settings -> results), compare_generations
    fields, forms                     the notebook forms (TenantForm, JobBuilder)
    cli, demo                         the ``mlora-lab`` command line

``Run.dashboard()`` is the one call down-room: the dashboard works on run directories (a
:class:`~mlora_lab.lab.runs.run.Run` is one: ``os.fspath(run)``) and never imports the handle.
"""
