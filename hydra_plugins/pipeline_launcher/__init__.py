"""Hydra launcher ``hydra/launcher=pipeline_slurm``: submitit's Slurm launcher, with Slurm resources per target.

Each job of a sweep goes to its target's partition and constraint (``target.slurm`` in conf/target/*.yaml) and asks
for as many GPUs as the capacity planner's TP × PP for that job. Jobs of the same target are submitted together as
one array. Discovered by Hydra through the ``hydra_plugins`` namespace package.
"""
