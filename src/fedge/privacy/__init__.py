"""Privacy for federated jobs: what a job asks (``settings``) and what it costs (``accounting``).

``settings`` needs nothing beyond the standard library (the agent's inference path reads
budgets with it); ``accounting`` composes releases with Opacus' accountants. DP-SGD itself
and the per-party budget ledger are the party's (:mod:`fedge.party.dp_sgd`,
:mod:`fedge.party.budget`); central DP and SecAgg+ are the aggregator's.
"""
