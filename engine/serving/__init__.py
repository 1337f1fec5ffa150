"""Serving the engines: one loop, two front ends (docs/decode-instances.md).

`loop`: the serving loop, one thread that owns the decode engine (and its prefill engine where there is a
store), its inbox, the requests' callbacks and the published load. On it: the HTTP API (`engine.api`),
and a decode instance, a process serving proto/decode.proto's DecodeInstance over gRPC (`instance`,
`config`, `service`, `messages`). `client` talks to an instance; `processes` starts and stops several.
"""
