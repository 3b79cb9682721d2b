"""The simulator: the real Scheduler and KVCacheManager on a modeled node.

specs.py (hardware/model data with sources) -> capacity.py (KV blocks) -> cost_model.py (pass
latency, roofline) -> sim_executor.py (an executor that advances a simulated clock) ->
simulator.py (discrete-event loop) -> metrics.py / report.py; bounds.py checks the design's
targets; fit.py calibrates the cost model to measured passes; cli.py is `everystop simulate`.
"""
