"""The compatibility report: schema, JSON (for machines), Markdown (to publish), merge."""
