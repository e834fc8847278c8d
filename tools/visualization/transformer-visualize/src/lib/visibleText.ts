/** A token's text with its newlines, tabs and other control characters written out (\n, \t, ...), so
 *  that every token takes visible room. */
export function visibleText(text: string): string {
  return JSON.stringify(text).slice(1, -1);
}
