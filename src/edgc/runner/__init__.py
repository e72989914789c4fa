"""The step runner's base pieces, on the lowest floors of the library: what the sync methods and the
engine build on, importing nothing above them.

Modules:
    error_feedback.py  `ErrorFeedback`: the one error feedback every method that keeps one holds.
"""
