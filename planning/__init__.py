"""How many workers of which role: pdserve's planning (``planning/README.md``).

Offline, ``pdserve plan`` searches placements — chunked or prefill-priority colocation, prefill:decode
splits, conditional disaggregation — for the most goodput per GPU, each candidate run on the event
simulator (``pdserve.simulator``) and judged against the workload's **work bound** (the rate no
layout sustains without shedding); the **fluid model** runs whole days at tens of GPUs. Online, the
**autoscaling planner** sizes the prefill and decode pools every interval from the router's
measured workload: a closed-form **capacity model** on the step-time model, **step corrections**
fitted to what the workers measured, a **keep-up** floor over the load it remembers, and an
**error budget** for the SLO; it drives a live deployment (``autoscale``) and the simulated
cluster (``sim_autoscale``) with the same code. Decisions are pure; putting workers on Ray or
Kubernetes is ``pdserve.deploy``'s.
"""
