"""`carousel bench`: drive an OpenAI-compatible endpoint and compare batching arms.

One workload (prompts, output lengths, arrival times; fixed by `--seed`) is replayed against
each arm in turn, selected with the `X-Carousel-Arm` header, so the comparison is fair on one
machine. Each run measures, per request, TTFT (to the first chunk with text), end-to-end
latency (to the end of the stream), TPOT = (latency - TTFT) / (output tokens - 1) and the
inter-token gaps between content chunks (ITL); per run, request, output-token and total-token
throughput over the run's wall time, and goodput, the rate of requests meeting the TTFT and
TPOT objectives. metrics.py states every definition precisely.

Modules: workload (DISTs, arrivals, prompts, datasets), replay (a traffic record as the
workload), public_traces and trace_replay (Azure, BurstGPT, Mooncake, ShareGPT traces as the
workload), exact_prompts (prompts of a token count, from the server's own usage), probe (one
request per arm before a run), client (streamed requests and timing), metrics, trace
(/debug/trace and seat layout), runner (arms x rates x repeats, Ctrl-C), stats and verdict
(bootstrap intervals and the plain sentences), comparison (the bench's verdict), report and
plots (report.json, report.md, PNGs), summary (the terminal's results block and verdict), extra
(the `[bench]` extra checked before a run), prom and ab (`carousel ab report` on a live split),
cli (`register` for the gateway CLI, and `main`).
"""
