"""The ElastiLM stages: profile, elastify, recover, latency, tlm, label, corpus, evaluate, export."""
