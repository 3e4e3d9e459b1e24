"""Advice over a report: for a setup the matrix ran, what to do instead when it is not safe.

Pure and stdlib-only, like `verdict`: report rows in, the nearest safe setups out; `freezecompat advise` prints them.
"""
