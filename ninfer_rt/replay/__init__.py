"""Replaying request traces against a running server: the trace format, the seven profiles, the runner
that sends them through the OpenAI API, and the report that judges the run (issue 11)."""
