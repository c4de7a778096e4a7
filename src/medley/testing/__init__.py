"""Scenarios that drive medley as a user would, shared by the test suite and the benchmarks:
:mod:`medley.testing.elastic_scenario` starts ``medley launch --elastic --local`` on emulated
nodes, kills and restarts them, and reads what they logged (``tests/runtime/test_elastic_launch.py``
and ``bench/elastic.py``). No other medley package imports them."""
