"""How replicas agree. Today DDP's synchronous all-reduce (trainyard.parallel.wrap); local SGD,
DiLoCo and a parameter server are to live here."""
