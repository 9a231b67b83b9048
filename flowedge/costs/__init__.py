"""The production cost model: device and link profiles, roofline costs, and tree sizing from them.

Below the engine so the engine, the planner, the daemon's head and the simulator all price work the
same way without importing one another (the simulator is one user of these costs, not their home).
"""
