"""The controller (the pytest process): plan once, run cells on the warm rank pool, judge, report.

It never imports rank-side code (`rank`, `adapters`, `models`): ranks are other processes.
"""
