"""The swarm expert backend: a MoE layer's pairs fanned out to the nodes that hold their experts.

Dimension letters: T tokens, K selected experts per token, D model width, N = T*K pairs.
Per layer and step: group the pairs expert-major (counts -> offsets -> pack), split the experts by the
holder `Placement.pick` chooses (placement), send one Compute call per node (several when its rows would
make a message over EngineConfig.call_bytes: a long prefill; see calls.split_parts), all at once
(dispatch); the model computes its shared expert meanwhile; `wait` writes each node's rows back at their packed offsets and
unpacks to [T, K, D] (pending). A node that fails (gone, deadline, refused) is marked down and its experts
are sent again to another holder; a node that stalls (no answer in a few times its usual time) is hedged:
its call goes to another holder too and the first complete answer is used. The weighted sum over K happens
in the model, in slot order, so the result never depends on which node answered first. `connect`
(discovery) finds the nodes: static peers, then mDNS, which the backend keeps following.
"""
