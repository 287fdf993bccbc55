"""What the compiled graph runs with besides kernels: locality domains and their weight shards
(locality.py). PDL needs no runtime of its own: the kernels take it as a launch argument."""
