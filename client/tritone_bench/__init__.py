"""Tritone's benchmark kit: one load protocol, one way to measure a stream, one result format.

Every benchmark here sends the same kind of load (a closed loop: N streams, each sending its
next request when its last one ends), reads every stream the same way (`stats`: time to first
token, inter-token latency per token), starts Tritone one way (`tritone.launcher.temporary_server`)
and writes its figures with the machine, commit and date they came from (`results`) under
bench_results/, from which `report` renders the tables of the docs.
"""
