"""The rollout's policies: what decides how the engine decodes, as pure host values and
transitions it calls once per chunk or rollout. `strategy.py` is an arm (a speculative
strategy, or plain decoding); `mab.py` the bandit that picks the arm per live-batch bucket
(BEG-MAB); `gate.py` whether speculation pays at a bucket on this hardware, from probes
(`probe.py`, placed where the rollout's time is by `placement.py`), funded by what the probe
can earn (`funding.py`, `payoff.py`: a compile must repay itself within the run), remembered
between runs (`verdicts.py`). `cells.py` holds the states for the duration of one call: the
engine takes them per call (`generate(..., policies=PolicyCells)`), its caller owns the cells
and reads the states back; between calls only the values exist (the train state's). They
import no engine module (tlt_jax/rollout/*.py) and run nothing on a device (verdicts.py asks
jax only which machine it is): the cluster simulator (tlt_jax/plan) drives the same policies
on a simulated clock.
"""
