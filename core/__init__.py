"""The shared core: block keys, prefix index, policies, Redis schema, config.

Everything else imports this package; it imports nothing of router/ or worker_agent/.
"""
