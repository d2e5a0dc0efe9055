"""The owner both backends share, and the pure policy it applies.

`coordinator` (the owner: a coordinator of the parts below, on a backend's `transport`),
`owner` (the one thread that changes slots and running tasks; callers hand it callables),
`ledger` (how a task ends, once; counters), `dispatcher` (steps 3-4 and the owner's side of
8-9), `watchdog` (timers), `stopping` (the stop path), `slots` (a slot as the owner sees it),
`transport` (the protocol a backend implements, and its event values), `admission` (the
queue: bounds, deadlines, backpressure), `recovery` (who is charged after a death: a pure
decision), `states` (lifecycles with transition tables), `task`, `config` (the validated
settings), `stats` and `metrics` (the accounting callers read), `reload` (a hot model swap).
Nothing here knows processes or Ray actors.
"""
