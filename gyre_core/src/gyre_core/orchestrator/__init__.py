"""The live orchestrator (``gyre-orchestrate run``): the scheduler driving real cells.

``run_config`` validates the run's configuration file and flags before anything starts;
``harness`` launches one harness process per execution with its own credential, directory and
home; ``live`` is the driver that feeds the world's events to the same
:class:`~gyre_core.scheduler.state_machine.Scheduler` the simulator drives and carries out its
commands on the cells, the proxy and the data plane; ``journal`` makes that state durable;
``embedded`` assembles the small default job that runs on one CPU machine.
"""
