from archlab.launch import main

main()
