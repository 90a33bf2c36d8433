"""The runner: the stage contract stages import (``contract``: ``Stage``, ``Context``, ``Shared``), the run's server
leases the serving stages take (``leases``), the code fingerprinting (``fingerprint``) and the executor that plans and
runs a build (``executor``: ``preflight``, ``run``). Nothing is imported here: a stage importing the contract does
not load the executor."""
