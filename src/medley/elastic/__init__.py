"""Elastic runs: keep training when nodes are lost, return or slow down (``medley launch --elastic``).

:mod:`.rank` is the body of every rank; :mod:`.decide` chooses the plan from who is present;
:mod:`.replan` runs the planner for the devices left. It sits above the runtime and the planner
(it runs both), below the command line.
"""
