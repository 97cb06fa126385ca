"""Trace-driven replay of one decode instance (`harvest replay`): harvest's scheduler
against SeparateMode, StaticMode and decode-only, from a latency profile. numpy and
matplotlib are its only third-party needs; nothing here imports torch."""
