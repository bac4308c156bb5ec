"""Where a MoE layer's experts are computed: the backend protocol and the in-process experts (backend.py),
the swarm's nodes (remote/), and the groups' turns at the dense work while they wait (turns.py)."""
