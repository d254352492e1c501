"""controller: what a server loads and decides with, built from a trained run.

``deploy`` (``DeployedController``: the policy folded into plain tensors with its table fallback;
``ctrl export``), ``predict`` (``ctrl predict``: the deployed decisions for a workspace's samples)
and ``latency_guard`` (``LatencyGuard``: which configurations a request may run on this machine,
for the online controller's rollouts, checks and served requests). Imports ``pipeline`` and
``trainer``; the trainer never imports it.
"""
