"""The owner core both backends share, and the pure policy it applies.

`owner` (the one thread that changes slots and running tasks; callers hand it callables),
`ledger` (how a task ends, once; counters), `admission` (the queue: bounds, deadlines,
backpressure), `recovery` (who is charged after a death: a pure decision), `states`
(lifecycles with transition tables), `task`, `config` (the validated settings), `stats` and
`metrics` (the accounting callers read), `reload` (a hot model swap's plan and rules).
Nothing here knows processes or Ray actors.
"""
