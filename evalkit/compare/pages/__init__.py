"""What a comparison renders for people, through the reports' one template (evalkit/page.py): the text report in
Markdown (markdown), the HTML page (html_page) with the documents that changed (documents), and the plots (plots).
The sweep report renders each point's comparison with these same modules, importing them from here."""
