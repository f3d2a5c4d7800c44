"""`disagg simulate` (issue #41): how a workload would run on a topology's machines, through
the real router over simulated nodes (engines/sim/), against the same machines served as
Ollama serves the grader today.

- `topology.py`  any topology's nodes as sim nodes on 127.0.0.1 (hardware profiles, the
                 machines they stand for, free ports; direct_ollama steps left out)
- `workload.py`  a `disagg batch` line as the prompt and answer length the nodes get
- `mesh.py`      the workload through the real routers and sim nodes (processes), timed
                 in real seconds times the speedup
- `baseline.py`  the Ollama baseline, the same engines on a virtual clock (`clock.py`)
- `report.py`    the two side by side: wall time, submissions per hour, TTFT and end-to-end
                 percentiles, per-node use, KV bytes moved, where the time went
- `run.py`       `simulate()`: all of the above for a topology and a workload file
- `calibrate.py` `disagg calibrate`: a profile of this machine, measured with the embedded
                 engine (a process of its own: llama.cpp loads before grpc)

Nothing is imported here, so that calibrate.py can load llama.cpp first.
"""
