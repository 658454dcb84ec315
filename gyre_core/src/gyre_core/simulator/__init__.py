"""The simulator behind ``gyre-orchestrate simulate``: the real scheduler driven against simulated
executions (``engine``), their sources (``workload``: traces and a synthetic generator), named
settings (``presets``), the Gyre/Async/Colocate race (``race``) and the role-timeline picture
(``timeline``)."""
