"""The Ray backend: `backend.RayEngine`, whose slots are Ray actors, and `data`, the Ray Data
adapter. Only this subpackage imports ray."""
