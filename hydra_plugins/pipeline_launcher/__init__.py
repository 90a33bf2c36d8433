"""Hydra plugins of ``python -m pipeline``.

- ``hydra/launcher=pipeline_slurm``: submitit's Slurm launcher, with Slurm resources per target. Each job of a sweep
  goes to its target's partition and constraint (``target.slurm`` in conf/target/*.yaml) and asks for as many GPUs
  as the capacity planner's TP × PP for that job, and the CPUs and host memory its plan needs. Jobs with the same
  resources are submitted together as one array; every array is submitted before the launcher waits on any. While
  waiting it counts the jobs queued (and why, from ``squeue``), running, done and failed, with the time elapsed; it
  ends with a summary of each job's Slurm job id, outcome and log, exits 1 naming the jobs that failed (the others
  run to the end), cancels its arrays on Ctrl-C (the summary then says which finished), and leaves them running
  on SIGHUP (``launcher.py``).
- ``hydra/sweeper=pipeline``: Hydra's basic (cartesian) sweeper, leaving out the jobs at the positions in
  ``hydra.sweeper.skip``. ``python -m pipeline VERB -m`` selects it when the plan-time checks refuse some jobs of a
  sweep (each is listed on stderr with its reason).

Discovered by Hydra through the ``hydra_plugins`` namespace package.
"""
