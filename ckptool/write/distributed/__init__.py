"""``convert`` on many processes through ``torch.distributed`` (gloo, CPU).

``world`` says where this process stands (torchrun, an env:// launcher,
``srun``) and joins the others; ``launch`` starts ``convert --workers N`` on
one machine through torch's elastic launcher. Each rank plans the same
conversion, writes its share of the output files, and one rank commits.
"""
