"""The step runner's base pieces, on the lowest floors of the library: what every sync method and the
engine build on and nothing above them is imported here (`error_feedback.ErrorFeedback`: the one error
feedback every method that keeps one holds).
"""
