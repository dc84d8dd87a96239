"""Know before you rent: the cluster simulator (`python -m tlt_jax.plan`). `cost.py` prices a
forward (bytes and FLOPs on a hardware profile; `calibrate.py` fits one on this machine),
`sim_engine.py` runs the engine's own loop (scheduler, pages, gate, bandit) on a simulated
device and clock (`sim_device.py`: its rows, executables and compile plan), `sim.py` whole RL
steps over the workers (`turns.py`: their chunks in the order of their clocks), `learner.py`
the learner's phases, `workload.py` the response lengths
and the drafts' acceptance, `report.py` the tables and the timeline. A leaf: it imports the
engine, no module outside it imports it (tests/test_tree.py checks it), so the simulator can
never change what a run does."""
