"""What an on-call engineer reads: metrics (Prometheus), logs (text or JSON).

Kept outside `domain/`: the rules stay pure, and what is counted or logged is
decided where the work is done (store, engine, API), through this package.
"""
