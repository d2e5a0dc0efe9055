"""The local backend: `pool.Engine`, whose slots are worker processes on this host, owned by
the core's coordinator on `transport.LocalTransport` (`supervisor`), one `slot.Slot` each."""
