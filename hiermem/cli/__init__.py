"""The ``hiermem`` command (:mod:`.main`): the demo, store inspection, the simulator and
the tuner, the planner."""
