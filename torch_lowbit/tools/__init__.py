"""Developer tools built on the library (table generators, codebook learner, GPU compile check): nothing in the library imports them."""
