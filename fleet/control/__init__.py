"""The fleet control plane: capacity limits, desired_count, the autoscaler and the actuators.

The decision (how many agents a tenant should have: :mod:`fleet.control.limits`,
:mod:`fleet.control.autoscaler`) is kept apart from the mechanism that makes
reality match it (:mod:`fleet.control.actuators`, driven by
:mod:`fleet.control.reconciler`).  :mod:`fleet.control.jobs` wires both into
``serve``.
"""
