"""The local backend: `pool.Engine`, whose slots are worker processes on this host, owned by
`supervisor.Supervisor` (one thread), one `slot.Slot` each; hot model swaps (`reload`)."""
